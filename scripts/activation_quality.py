"""What int8 activations cost in quality: the embedded SmolLM2 on its own GGUF blocks with int8 activations
against the same blocks with fp32 activations (the exact reference), on held-out text: CPython modules the
shipped draft never trained on (json, email) and the Python documentation's prose (pydoc_data.topics, the
reference manual's text). Per set: mean KL(fp32 || int8) of the next-token distribution, top-1 agreement,
and each form's perplexity of the text.

Usage: PYTHONPATH=. python scripts/activation_quality.py [--tokens 20000] [--window 512] [--threads 2]
    [--gguf FILE]  (another GGUF of the same model, e.g. a requantized one from make_gguf_variants.py)
"""

import argparse
import math
import sysconfig
from pathlib import Path

import torch
from tqdm import tqdm

from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.kv_cache import KVCache
from blockspec.models.default_model import ensure_default_model, gguf_path
from blockspec.models.loader import load_target
from blockspec.models.tokenizer import Tokenizer
from blockspec.train.data import HELDOUT_MODULES


def held_out_sets() -> dict[str, str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [path.read_text(encoding="utf-8") for module in HELDOUT_MODULES
            for path in sorted((stdlib / module).rglob("*.py")) if "test" not in path.parts]
    from pydoc_data.topics import topics

    return {f"CPython {'/'.join(HELDOUT_MODULES)} modules": "\n\n".join(code),
            "Python docs prose (pydoc topics)": "\n\n".join(topics[key] for key in sorted(topics))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000, help="tokens scored per set")
    parser.add_argument("--window", type=int, default=512, help="tokens per forward (each window's context)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", type=Path, default=None, help="the model's blocks from this file instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = ensure_default_model(weights=False)
    tokenizer = Tokenizer.from_folder(folder)
    targets = {}
    for form in ("fp32", "int8"):
        target = load_target(folder, torch.float32, torch.device("cpu"), "stored", args.gguf or gguf_path())
        target.fold_norm_weights()
        if form == "int8":
            target.use_int8_activations()
        targets[form] = target
    print(f"| held-out text | tokens | mean KL(fp32 ‖ int8) | top-1 agreement | perplexity fp32 | "
          f"perplexity int8 |\n|---|---|---|---|---|---|")
    for name, text in held_out_sets().items():
        ids = tokenizer.encode(text)[: args.tokens + 1]
        kl_sum = agree = count = 0.0
        nll = {form: 0.0 for form in targets}
        for start in tqdm(range(0, len(ids) - 1, args.window), desc=name, leave=False):
            window = torch.tensor([ids[start : start + args.window + 1]])
            inputs, labels = window[:, :-1], window[0, 1:]
            logprobs = {}
            with torch.inference_mode():
                for form, target in targets.items():
                    cache = KVCache.for_model(target, 1, inputs.shape[1])
                    hidden, _ = target(ForwardBatch.in_cache(cache, [0], [0], inputs))
                    logprobs[form] = target.logits(hidden)[0].log_softmax(-1)
            exact, approx = logprobs["fp32"], logprobs["int8"]
            kl_sum += (exact.exp() * (exact - approx)).sum(-1).sum().item()
            agree += (exact.argmax(-1) == approx.argmax(-1)).sum().item()
            count += labels.numel()
            for form, lp in logprobs.items():
                nll[form] -= lp.gather(-1, labels.view(-1, 1)).sum().item()
        print(f"| {name} | {int(count)} | {kl_sum / count:.5f} | {agree / count:.4f} | "
              f"{math.exp(nll['fp32'] / count):.3f} | {math.exp(nll['int8'] / count):.3f} |")


if __name__ == "__main__":
    main()
