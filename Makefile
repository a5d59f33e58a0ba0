# ft's entry points. Run as root: the lab creates network namespaces and starts daemons.
VENV ?= .venv
FT := $(VENV)/bin/ft

.PHONY: help setup lab demo test test-unit lint bench down purge

help:
	@echo "make demo       install everything, bring the lab up, run ft's main job on it"
	@echo "make test       the whole test suite (installs and brings the lab up as needed)"
	@echo "make test-unit  tests that need no lab"
	@echo "make lint       ruff, ansible-lint (production), shellcheck"
	@echo "make bench      benchmarks (benchmarks/)"
	@echo "make down       stop the lab;  make purge  stop it and delete its state"

setup:
	scripts/setup.sh

lab: setup
	$(FT) lab up

# The main job on the local lab: a real 2-node LoRA SFT fine-tune submitted through ft.
demo:
	scripts/demo.sh

test:
	scripts/test.sh

test-unit: setup
	$(VENV)/bin/python -m pytest tests/unit

lint: setup
	$(VENV)/bin/ruff check toolkit tests benchmarks
	cd ansible && ../$(VENV)/bin/ansible-lint
	shellcheck .ci/run scripts/*.sh benchmarks/*.sh ansible/roles/slurm/files/ft-healthcheck ansible/roles/slurm/files/healthcheck.d/*

bench: lab
	$(VENV)/bin/python benchmarks/lab_up.py
	$(VENV)/bin/python benchmarks/control_plane.py
	$(VENV)/bin/python benchmarks/data_validation.py
	$(VENV)/bin/python benchmarks/training.py

down:
	$(FT) lab down

purge: setup
	$(FT) lab down --purge
