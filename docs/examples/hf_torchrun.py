"""Sharded decoding of a transformers model under torchrun, with treeattn.hf.

    torchrun --nproc-per-node 2 docs/examples/hf_torchrun.py --model PATH_OR_NAME \
        --prompt "The capital of France is" --max-new-tokens 32

Every rank loads the same model and tokenises the same prompt. The prompt is prefilled
sharded (each rank runs the model on its own chunks of it), then transformers' own
``generate`` decodes with every step's attention reduced across the ranks by the planner's
pick. Rank 0 prints the text. ``--check`` also runs transformers' single-process ``generate``
on rank 0 and exits 1 unless the tokens are the same. ``--tiny`` uses a small random Llama
(grouped-query attention) and random token ids instead of a model: what the test suite runs.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import transformers

import treeattn.hf


def tiny_model():
    torch.manual_seed(0)  # the same weights on every rank
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model name or folder")
    parser.add_argument("--tiny", action="store_true", help="a small random Llama instead")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--algorithm", default="auto", help="a treeattn algorithm, or auto")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")  # "nccl" with one GPU per rank
    torch.set_num_threads(1)
    if args.tiny:
        model, tokenizer = tiny_model().eval(), None
        ids = torch.randint(0, 128, (1, 21), generator=torch.Generator().manual_seed(1))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    greedy = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                  do_sample=False)
    want = model.generate(ids, **greedy) if args.check and dist.get_rank() == 0 else None

    model.set_attn_implementation("treeattn")
    cache = treeattn.hf.ShardedCache(model.config, args.algorithm,
                                     reserve=args.max_new_tokens)
    treeattn.hf.sharded_prefill(model, ids, cache)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, **greedy)

    code = 0
    if dist.get_rank() == 0:
        new = out[0, ids.shape[1]:]
        print(tokenizer.decode(new, skip_special_tokens=True) if tokenizer else new.tolist())
        print(f"rank 0 holds {cache.layers[0].local} of {cache.get_seq_length()} positions",
              file=sys.stderr)
        if want is not None:
            same = torch.equal(out, want)
            print(f"identical to transformers in one process: {same}", file=sys.stderr)
            code = 0 if same else 1
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
