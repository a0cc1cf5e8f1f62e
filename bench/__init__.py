"""`make bench`: this runtime against HF transformers and llama.cpp, on one machine in one run.

Every runtime is measured in its own child process with the same protocol (greedy first token
from the same prompt ids, then greedy decode steps), so time and peak memory belong to one
runtime and nothing warmed by another. This module stays free of third-party imports: the
llama.cpp side runs under its own interpreter, which has none of the project's packages.
"""


class BenchError(Exception):
    """A part of the bench could not run; the message says what and where its log is."""
