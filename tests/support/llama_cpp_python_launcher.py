"""Start llama-cpp-python's OpenAI server (``python -m llama_cpp.server``) the way the
embedded engine loads its model: on a CPU that reports Intel AMX, without llama.cpp's
"extra buffer types" (the stock server crashes inside ggml's AMX matrix multiply
there; see ``bourse.engines.llamacpp_native.model_params``). Every argument is handed to the
server's own command line unchanged.

Run as ``python -m tests.support.llama_cpp_python_launcher --model PATH --port N ...``.
"""

from __future__ import annotations

import sys


def main() -> None:
    import llama_cpp
    import llama_cpp.server.__main__ as server_main

    from bourse.engines.llamacpp_native import has_amx

    if has_amx():
        low = llama_cpp.llama_cpp
        default = low.llama_model_default_params

        def params() -> object:
            p = default()
            p.use_extra_bufts = False
            return p

        low.llama_model_default_params = params
    sys.argv[0] = "llama_cpp.server"
    server_main.main()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
