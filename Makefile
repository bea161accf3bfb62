# The two commands of README.md: `make serve` and `make test`. Both install what is missing.
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1
export VLLM_NO_USAGE_STATS ?= 1

.PHONY: install serve test check check-protos gen bench soak

install:
	./scripts/install.sh

serve: install
	$(BIN)/enginectl serve $(ARGS)

gen: install
	$(BIN)/python scripts/gen_protos.py

# Lint, breaking-change check, generated-code check.
check-protos: install
	$(BIN)/buf lint
	$(BIN)/buf breaking --against proto-baseline/enginectl-v1.json
	$(BIN)/python scripts/gen_protos.py --check

# Static checks: protos, generated code, types.
check: check-protos
	$(BIN)/mypy

test: install check
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m bench $(ARGS)

# A bounded soak of one server (default 10 minutes; ARGS="--duration 90"); not part of `test`.
soak: install
	$(BIN)/python -m bench.soak $(ARGS)
