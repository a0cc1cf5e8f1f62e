"""The command lines: `make run` / `make chat` (`run`), `make compile` (`compile`) and the
`make profile` report."""
