"""The command lines: `make run` / `make chat` (`run`), `make serve` (`serve`), `make compile`
(`compile`), the `make profile` report, and the flags they all share (`options`)."""
