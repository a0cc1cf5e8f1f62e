"""Generation over the engine, in two layers: tokens (tokens.py: prefill, decode, each token
with the logits it was chosen from, shaped by the logits processors and picked by the sampler)
under text (`Session.generate`: detokenizing, stop strings, log probabilities, timing). Also
the grammars and the conversation. It raises the runtime's own errors, never HTTP ones."""
