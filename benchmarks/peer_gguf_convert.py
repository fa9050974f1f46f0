"""llama.cpp's convert_hf_to_gguf.py for a model whose tokenizer it does not recognise (peer_llamacpp.py:
prompts go to its server as token ids, so the pre-tokenizer is never used): the tokenizer is written
with llama.cpp's "default" pre-tokenizer instead of failing.

    python peer_gguf_convert.py LLAMA_CPP_TREE MODEL_DIR --outtype q8_0 --outfile model.gguf
"""

import runpy
import sys

if __name__ == "__main__":
    tree = sys.argv.pop(1)
    sys.path.insert(0, tree)
    from conversion import base  # llama.cpp's package, from its tree

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    runpy.run_path(f"{tree}/convert_hf_to_gguf.py", run_name="__main__")
