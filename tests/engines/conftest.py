"""The vLLM tests: `make test-engines` (not in `make test`: they need vLLM's venv)."""
