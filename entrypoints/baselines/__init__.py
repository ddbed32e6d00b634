"""Other engines on tokenmill's benchmark workloads, each in its own process and venv.

`external` builds the spec (the exact token-id prompts tokenmill ran), starts a runner script
under the other engine's interpreter and reads its results back; `plot` draws the workloads side
by side. The runners (`vllm_runner.py`, `llamacpp_runner.py`) are standalone scripts: they import
no tokenmill module, since they run under another venv's python.
"""
