"""llama.cpp's convert_hf_to_gguf.py for a model with bench_peers' word-level tokenizer (one word per id,
split on whitespace; peer_llamacpp.py sends prompts as token ids, so it is never used to encode): it is
written as llama.cpp's "whitespace" tokenizer, which is what it is, instead of failing as an unknown BPE.

    python peer_gguf_convert.py LLAMA_CPP_TREE MODEL_DIR --outtype q8_0 --outfile model.gguf
"""

import runpy
import sys

if __name__ == "__main__":
    tree = sys.argv.pop(1)
    sys.path.insert(0, tree)
    from conversion import base  # llama.cpp's package, from its tree

    def whitespace_vocab(self) -> None:
        base.TextModel._set_vocab_whitespace(self)
        # llama.cpp's loader wants a merges list for every BPE-family vocabulary; a word-level one has no
        # merges, and one that joins no two of its words is inert.
        self.gguf_writer.add_token_merges(["<unk> <unk>"])

    base.TextModel._set_vocab_gpt2 = whitespace_vocab
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "whitespace"  # its hash is not in the table
    runpy.run_path(f"{tree}/convert_hf_to_gguf.py", run_name="__main__")
