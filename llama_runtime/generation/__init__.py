"""Generation over the engine: the `Session`, sampling, log probabilities, grammars and the
conversation. It raises the runtime's own errors, never HTTP ones."""
