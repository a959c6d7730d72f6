# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create the virtualenv on first use and reinstall when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint demo bench bench-openssh clean lock deb

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python scripts/check_vps_portable.py

# The suite runs in TEST_WORKERS parallel processes (pytest-xdist; its tests mostly wait on
# sockets and timeouts, so more workers than cores pay: docs/benchmarks.md, "The test suite").
# Tests that share an expensive module-scoped fixture (a stack, a built package) carry an
# xdist_group mark, so one worker builds it once (--dist loadgroup). pytest 9.2 drops that
# mark (pytest-xdist issue 1386), hence pytest<9.2 in pyproject.toml; tests/conftest.py fails
# a grouped test whose group did not reach the scheduler. 4 workers on 2 cores: about 14 min
# instead of 40 serially. `make test TEST_WORKERS=0` runs it serially.
TEST_WORKERS ?= 4

test: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=10 $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/monitord demo

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# The migration on real OpenSSH: 1, 10 and 100 areas moved to the fault tier's namespace VPS
# (a Debian root's sshd), against the floor and an operator's rsync by hand in the same run.
# Root, iproute2, nftables, openssh-server, rsync and mmdebstrap (or built roots); about 2 min
# (docs/benchmarks.md, "Real OpenSSH"). `make bench-openssh BENCH_AREAS="1 10"`: fewer sizes;
# BENCH_LINK=wan (or far, or a spec like delay=40ms,rate=20mbit): across that WAN link.
BENCH_AREAS ?=
BENCH_LINK ?= lan

bench-openssh: $(STAMP)
	$(BIN)/python -m benchmarks.openssh_vps --link $(BENCH_LINK) $(BENCH_AREAS)

# The PBX side as one Debian package, dist/monitord_VERSION_amd64.deb, from requirements.lock
# (scripts/deb.py; docs/install.md). `make lock` re-resolves the lock from pyproject.toml.
lock: $(STAMP)
	$(BIN)/python scripts/deb.py lock

deb: $(STAMP)
	$(BIN)/python scripts/deb.py build

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache dist
