"""Generate the bundled image-text set: small images of coloured shapes, conversations about them, the bundled
tokenizer with Qwen3-VL's image tokens added (and with Muse Spark's), and an image processor config for images this
small.

Everything is drawn by this script (Pillow, no anti-aliasing, fixed seed): nothing is downloaded. Run from the
repository root:

    python src/openrecipes/data/assets/image_text/make_image_text.py
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
BUNDLED_TOKENIZER = HERE.parent / "tokenizer"
# Qwen3-VL's image and video tokens, added after the bundled tokenizer's 1,024 (ids 1024-1027): the tiny
# Qwen3-VL-MoE config (qwen3-vl-moe-tiny) names these ids
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Muse Spark's image-turn tokens (data/templates.py MUSE_SPARK_IMAGE) and the video and audio placeholders, after the
# bundled tokenizer's 1,024 (ids 1024-1028): the tiny Muse Spark with towers (muse-spark-tiny-vl) names these ids
MUSE_SPARK_TOKENS = ["<|image_start|>", "<|image_end|>", "<|image|>", "<|video|>", "<|audio|>"]
MUSE_SPARK_TEMPLATE = HERE.parent / "templates" / "muse_spark.jinja"
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 40)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((32, 32), (48, 32), (32, 48))  # (width, height): one to three merged tokens per 8 pixels each way
# processor of the tiny model: 4-pixel patches merged 2 x 2, images kept between 32 x 32 and 64 x 64 pixels
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 4, "temporal_patch_size": 2,
             "merge_size": 2, "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255, "resample": 3}


def draw(shape: str, colour: tuple[int, int, int], size: tuple[int, int], background: int) -> Image.Image:
    width, height = size
    image = Image.new("RGB", size, (background,) * 3)
    pen = ImageDraw.Draw(image)
    side = min(width, height) - 8
    left, top = (width - side) // 2, (height - side) // 2
    box = (left, top, left + side, top + side)
    if shape == "circle":
        pen.ellipse(box, fill=colour)
    elif shape == "square":
        pen.rectangle(box, fill=colour)
    else:
        pen.polygon([(left + side // 2, top), (left, top + side), (left + side, top + side)], fill=colour)
    return image


def main() -> None:
    rng = random.Random(0)
    images = HERE / "images"
    images.mkdir(exist_ok=True)
    drawn = []
    for index, (shape, colour) in enumerate((s, c) for s in SHAPES for c in COLOURS):
        for variant, size in enumerate(SIZES):
            name = f"{colour}-{shape}-{variant}.png"
            draw(shape, COLOURS[colour], size, background=235 - 20 * variant).save(images / name, optimize=True)
            drawn.append((name, shape, colour))
    records = []
    for name, shape, colour in drawn:
        question = rng.choice(["What is in this picture?", "Describe the image.", "What shape and colour is this?"])
        records.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"images/{name}"},
                                         {"type": "text", "text": question}]},
            {"role": "assistant", "content": f"A {colour} {shape} on a grey background."}]})
    for _ in range(12):  # two images: which one shows a shape
        (a, sa, ca), (b, sb, cb) = rng.sample(drawn, 2)
        records.append({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "First image: "},
                                         {"type": "image", "image": f"images/{a}"},
                                         {"type": "text", "text": " Second image: "},
                                         {"type": "image", "image": f"images/{b}"},
                                         {"type": "text", "text": " What do the two images show?"}]},
            {"role": "assistant", "content": f"The first shows a {ca} {sa}, the second a {cb} {sb}."}]})
    rng.shuffle(records)
    with open(HERE / "conversations.jsonl", "w", encoding="utf-8") as out:
        out.writelines(json.dumps(r) + "\n" for r in records)
    (HERE / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2) + "\n", encoding="utf-8")
    make_tokenizer(HERE / "tokenizer")
    make_tokenizer(HERE / "muse_spark_tokenizer", MUSE_SPARK_TOKENS, MUSE_SPARK_TEMPLATE)
    print(f"wrote {len(drawn)} images and {len(records)} conversations to {HERE}")


def make_tokenizer(out: Path, tokens: list[str] = VISION_TOKENS, template: Path | None = None) -> None:
    """The bundled tokenizer with ``tokens`` added as special tokens; its chat template, or ``template`` instead."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    out.mkdir(exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    shutil.copyfile(BUNDLED_TOKENIZER / "tokenizer_config.json", out / "tokenizer_config.json")
    shutil.copyfile(template or BUNDLED_TOKENIZER / "chat_template.jinja", out / "chat_template.jinja")


if __name__ == "__main__":
    main()
