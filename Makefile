# Everything bootstraps itself: `make demo` and `make test` work on a fresh machine.
# Heavy downloads (pip wheels, Maven jars, harness CLIs) are cached under ~/.cache/polarstream.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CACHE ?= $(HOME)/.cache/polarstream
export PIP_CACHE_DIR := $(CACHE)/pip
STAMP := $(VENV)/.installed

.PHONY: venv system demo test test-fast containers-test bench infra-up infra-down harnesses datasets-peer vllm-peer clean

venv: $(STAMP)

# Debian packages: the sandboxes (bubblewrap; podman with runc for tasks that bring an image, mmdebstrap
# for their offline Debian bases, Docker's registry for the test that pulls a task's prebuilt image), Slurm with munge
# (the Slurm launcher's test starts a one-node cluster, no systemd) and the viewer's browser test (chromium); Java 17 and Maven come with
# the machine.
system:
	@command -v bwrap >/dev/null || { echo "installing bubblewrap (sandbox runtime)"; \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	  { $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -q >/dev/null && \
	    $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q bubblewrap >/dev/null; } || \
	  echo "warning: bubblewrap could not be installed; sandboxed runs will use the subprocess runtime"; }
	@{ command -v podman && command -v runc && command -v mmdebstrap && command -v docker-registry; } >/dev/null || { \
	  echo "installing podman, runc, mmdebstrap and docker-registry (containers for tasks with an image)"; \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q podman runc mmdebstrap docker-registry >/dev/null 2>&1 || \
	  { $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -q >/dev/null && \
	    $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q podman runc mmdebstrap docker-registry >/dev/null; } || \
	  echo "warning: podman could not be installed; tasks with an image cannot run here"; }
	@{ command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null || { \
	  echo "installing slurm-wlm and munge (the Slurm launcher's test runs a one-node cluster here)"; \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 || \
	  { $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -q >/dev/null && \
	    $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q slurm-wlm munge >/dev/null; } || \
	  echo "warning: slurm-wlm could not be installed; the Slurm launcher's test will skip"; }
	@command -v chromium >/dev/null || { echo "installing chromium (headless browser for the viewer test)"; \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -q >/dev/null && \
	    $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q chromium >/dev/null; } || \
	  echo "warning: chromium could not be installed; the viewer's browser test will skip"; }

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,smollm2]'
	$(PY) -m pip check
	@touch $(STAMP)

harnesses: venv
	$(VENV)/bin/polarstream harness install

# HF `datasets` cannot live beside our pins (its hub client needs click>=8.4.2, faust forbids it), so the
# export test loads our parquet/JSONL with it from a venv of its own, cached outside the clone.
DATASETS_PEER := $(CACHE)/peers/datasets-venv
datasets-peer:
	@$(DATASETS_PEER)/bin/python -c "import datasets" 2>/dev/null || { rm -rf $(DATASETS_PEER) && \
	  $(PYTHON) -m venv $(DATASETS_PEER) && $(DATASETS_PEER)/bin/pip install -q 'datasets>=4,<6'; } || \
	  echo "warning: could not build $(DATASETS_PEER); the HF datasets export check will skip"

# vLLM is the oracle for its weight-transfer routes and trainer API (tests/engine/test_vllm_oracle.py,
# tests/trainer/test_vllm_api.py): the pinned wheel (trainer/sync/vllm_api.py: VLLM_SUPPORTED) in a venv of its
# own (9.5 GB with its CUDA torch; it imports and runs its gloo-capable parts on a CPU), cached outside the clone.
VLLM_PEER := $(CACHE)/peers/vllm-venv
VLLM_PEER_PIN := vllm==0.33.0
vllm-peer:
	@$(VLLM_PEER)/bin/python -c "import vllm.distributed.weight_transfer" 2>/dev/null || { rm -rf $(VLLM_PEER) && \
	  $(PYTHON) -m venv $(VLLM_PEER) && $(VLLM_PEER)/bin/pip install -q '$(VLLM_PEER_PIN)'; } || \
	  echo "warning: could not build $(VLLM_PEER); the vLLM oracle tests will skip"

demo: venv system
	$(VENV)/bin/polarstream demo

# The suite runs on three pytest-xdist workers, each with its own Kafka broker and S3 server: in one
# process the 2-core machine sat 58% idle (tests wait on brokers, subprocesses and timeouts) and took
# 23.2 min; three workers took 12.1 (issue 47's note). With an empty model cache (.ci/run), three took 859 s of
# pytest and 1,264 CPU-s at 60e0f58, once OpenMP threads waited passively (tests/conftest.py); with spinning
# ones, 1,306 s and 2,054 CPU-s at cb92472 (issue 60). Four workers were slower: more JVMs on the same 2 cores.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3
test: venv system harnesses datasets-peer vllm-peer
	$(PY) -m pytest -q -ra --durations=25 --cpu 25 -m "not containers" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist load)

test-fast: venv
	$(PY) -m pytest -q -ra -m "not integration and not harness and not slow and not containers"

# The project image and a run of examples/arith.yaml across containers (docs/deploy.md): longer than make
# test's 15 minutes allow, so a target of its own, in one process.
containers-test: venv system
	$(PY) -m pytest -q -ra -m containers tests/deploy

# Reruns only the benchmarks whose measured code changed since they ran (bench/_provenance.py) and merges
# them into bench/results/latest.json; BENCH_ARGS=--all reruns every one, --cluster --harnesses the opt-in ones.
bench: venv
	$(PY) bench/run_all.py $(BENCH_ARGS)

infra-up: venv
	$(VENV)/bin/polarstream infra up

infra-down: venv
	$(VENV)/bin/polarstream infra down

clean:
	rm -rf $(VENV) .polar
