# The two commands of README.md: `make serve` and `make test`. Both install what is missing.
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1
export VLLM_NO_USAGE_STATS ?= 1

# The Python folders ruff checks and formats.
PY_DIRS := client server worker common contract cli scripts tests bench examples

.PHONY: install serve test unit check check-protos gen bench soak recovery-soak mypy-tree imports

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

# mypy cannot follow the editable install's import hook: lay the enginectl.* namespace out as
# links (pyproject.toml's package-dir) under build/mypy, where [tool.mypy] looks for it.
mypy-tree: install
	rm -rf build/mypy
	$(BIN)/python -c "$$MYPY_TREE"

define MYPY_TREE
import pathlib, tomllib
dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
tree = pathlib.Path("build/mypy/enginectl")
tree.mkdir(parents=True)
for entry in sorted(pathlib.Path(dirs.pop("enginectl")).iterdir()):
    if entry.name != "__pycache__" and not entry.is_symlink():  # the links: package-dir's, below
        (tree / entry.name).symlink_to(entry.resolve())
for name, folder in dirs.items():
    link = tree.joinpath(*name.split(".")[1:])
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(pathlib.Path(folder).resolve(), target_is_directory=True)
endef
export MYPY_TREE

# The import rules ([tool.importlinter]), for `check` and the pre-commit hook; a bare
# `lint-imports` runs the same. grimp reads the enginectl package where the editable install
# puts it, protos/enginectl, whose links (cli, client, ...) show it every folder of package-dir.
# No cache: the graph takes 0.1 s to build.
imports: install
	$(BIN)/lint-imports --no-logo --no-cache

# Static checks: protos, generated code, lint, formatting, types, import rules.
check: check-protos mypy-tree
	$(BIN)/ruff check $(PY_DIRS)
	$(BIN)/ruff format --check $(PY_DIRS)
	$(BIN)/mypy
	$(MAKE) --no-print-directory imports

test: install check
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The in-process tests alone (tests/unit/): no server, no engine, no child process; seconds.
# `make test` runs them too, with the end-to-end tests of tests/e2e/.
unit: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m bench $(ARGS)

# A bounded soak of one server (default 10 minutes; ARGS="--duration 90"); not part of `test`.
soak: install
	$(BIN)/python -m bench.soak $(ARGS)

# Partial updates, forced resumes and recoveries checked against a fresh engine (bench/recovery/run.py; ARGS="--rounds 4").
recovery-soak: install
	$(BIN)/python -m bench.recovery $(ARGS)
