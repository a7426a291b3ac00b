"""The vLLM tests run where vLLM is installed (``scripts/vllm_check.sh`` makes such an
environment); each test module skips itself otherwise.

vLLM's engine stays in this process, and its compile cache is off: with it on (vLLM's default
on torch >= 2.10) a second engine of the same model and config would load the first one's
AOT-compiled artifact instead of compiling through the backend object under test
(``test_aot_compile.py`` turns it on in processes of its own). Its cache root is a folder of
the test session, never the user's.
"""

import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="fxsplit-vllm-cache-"))
