"""vLLM helpers: `tiny_model.build_tiny_model` (an offline random Llama) and run_engine.py (one real
vLLM engine per process, run by path: `support.VLLM_SCRIPTS / "run_engine.py"`). Both also run as
scripts and import nothing from `support`."""
