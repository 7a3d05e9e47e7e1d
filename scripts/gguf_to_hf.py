"""Convert a GGUF file into a Hugging Face model folder (config, safetensors weights,
tokenizer, generation config) with ``transformers``, for engines that load such a folder
(vLLM). Run by ``scripts/test-engines`` with the vLLM virtualenv's Python, which has
``transformers``, ``torch`` and ``gguf``: ``python scripts/gguf_to_hf.py GGUF OUT``.

The GGUF's quantized weights are dequantized at load (``GgufConfig(dequantize=True)``;
transformers would otherwise keep them packed, and a packed model cannot be saved) and
saved as plain bfloat16 safetensors (vLLM's CPU backend computes in bfloat16 and would
downcast float32 at every load), with the quantization config removed so that the folder
reads as an ordinary checkpoint. The folder is written to ``OUT.tmp``
first and renamed, so that an interrupted run leaves no half folder behind.

The packaged Gemma 3 270M GGUF carries no ``tokenizer.chat_template``: without one vLLM
refuses every chat request, so the folder gets Gemma's own turn format
(:data:`GEMMA_CHAT_TEMPLATE`), the format llama-cpp-python's ``--chat_format gemma`` uses.
And transformers drops the file's ``tokenizer.ggml.add_bos_token``: without it put back,
a legacy completion's prompt is tokenized with no ``<bos>`` (``/tokenize`` of
``"Hello world"`` gives 2 tokens where llama.cpp counts 3).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""Gemma's turns; a system message is sent as a user turn, as Gemma has no system role."""


def _adds_bos(gguf: Path) -> bool:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.contents()) if field is not None else False


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    if _adds_bos(gguf):
        tokenizer.add_bos_token = True
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: gguf_to_hf.py GGUF OUT_FOLDER", file=sys.stderr)
        return 2
    convert(Path(argv[1]), Path(argv[2]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
