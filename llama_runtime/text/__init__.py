"""Text and tokens: the checkpoint's tokenizer, and the chat layouts a vocabulary supports."""
