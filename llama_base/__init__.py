"""What every other package stands on: the model config, the error types users see, and where
the project keeps its files. It imports nothing of the project."""
