"""The naive approach of seed 000: one Python process per image that loads the model, classifies, exits.

    python -m benchmarks.per_process_classify IMAGE --model resnet152 --weights WEIGHTS.pt

Written the way such a script usually is (torchvision transforms on a full Pillow decode, eager
fp32, batch 1), so experiment (a) measures the approach rather than a strawman; the transforms are
the model's preprocessing (benchmarks/harness/eval_transform.py), the same pixels as vision-serve's. Prints the top-5
as JSON on one line.
"""

from __future__ import annotations

import argparse
import json

import torch
from PIL import Image

from benchmarks.harness.eval_transform import eval_transform, upright_rgb
from compile import get_model_entry, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image")
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--weights", required=True, help="a state_dict file, imagenet or random")
    args = parser.parse_args()
    entry = get_model_entry(args.model)
    model = load_model(entry, args.weights).module
    transform = eval_transform(entry.preprocess)
    with Image.open(args.image) as image:
        batch = transform(upright_rgb(image)).unsqueeze(0)
    with torch.inference_mode():
        probabilities, indices = model(batch).softmax(dim=1).topk(5, dim=1)
    pairs = zip(indices[0].tolist(), probabilities[0].tolist(), strict=True)
    top5 = [{"label": entry.labels[i], "probability": p} for i, p in pairs]
    print(json.dumps(top5))


if __name__ == "__main__":
    main()
