"""The inference worker: stock vLLM `AsyncLLM`, the queue pull loop, sampling mapping, OpenAI serving.

Import the submodules you need; importing this package does not import vLLM (the worker entry point
must set vLLM's process environment first, see `process_env.configure_vllm_process_env`).
"""
