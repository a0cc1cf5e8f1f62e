"""Run time, model side: weights and checkpoints, the model resident on a device, host math,
tokenizer, sampling, chat, and the command lines (`make run`, `make chat`, `make compile`)."""
