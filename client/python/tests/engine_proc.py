"""An engine in its own process: loads the test model and prefills through kvtier.

    engine_proc.py store  ADDR MODEL_DIR PROMPT_FILE                -> stores the prompt's KV
    engine_proc.py reload ADDR MODEL_DIR PROMPT_FILE OUT N_TOKENS   -> reloads, greedy-decodes,
                                                                       saves tokens and logits
"""

import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from transformers import LlamaForCausalLM

import kvtier
from kvtier.transformers import KvCacheStore


def main():
    mode, addr, model_dir, prompt_file = sys.argv[1:5]
    torch.set_num_threads(2)
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    store = KvCacheStore(kvtier.Client(addr, never_raise=False), model, tenant="e2e", model_id="test-llama@seed0")
    prompt = json.load(open(prompt_file))
    if mode == "store":
        step = store.prefill(prompt)
        print(json.dumps({"reused": step.reused_tokens, "lookup": store.lookup(prompt)}))
    elif mode == "reload":
        out, n = sys.argv[5], int(sys.argv[6])
        step = store.prefill(prompt, store=False)
        tokens, logits = store.greedy(step, n)
        torch.save({"tokens": tokens, "logits": logits, "reused": step.reused_tokens}, out)
        print(json.dumps({"reused": step.reused_tokens}))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
