"""``diffspec generate``: stream one generation to the terminal, in process or through a gateway."""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from diffspec.errors import InvalidRequest
from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from draft_service.backend import DraftOptions
from gateway.request import GenerationRequest


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return args.prompt_file.read_text()
    except OSError as bad:
        raise InvalidRequest(f"cannot read --prompt-file: {bad}") from None


def draft_options(settings: DiffSpecSettings) -> DraftOptions | None:
    """None for Auto; otherwise the draft's policy, budget and salience switch."""
    if settings.policy == "auto":
        return None
    return DraftOptions(policy=settings.policy, tree_config=settings.tree_config, salience=settings.salience)


class PrefillBar:
    """A progress bar on stderr for prompts that take more than one prefill chunk."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None and done < total:
            self.bar = tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, leave=False)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if done >= total:
                self.bar.close()


async def run_generate(args: argparse.Namespace, settings: DiffSpecSettings) -> int:
    text = read_prompt(args)
    if args.gateway:
        from gateway.client import stream_generate

        chunks = stream_generate(args.gateway, text, args, settings)
    else:
        from gateway.assembly import build_engine

        options = draft_options(settings)
        engine = build_engine(settings, with_draft=options is not None)
        engine.prefill_progress = PrefillBar()
        request = GenerationRequest(
            prompt_ids=engine.tokenizer(text)["input_ids"],
            max_new_tokens=settings.max_new_tokens,
            sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed),
            stop_sequences=tuple(args.stop),
            draft=options,
        )
        chunks = engine.generate(request)
    all_ids: list[int] = []
    all_text = ""
    async for chunk in chunks:
        all_ids += chunk.token_ids
        all_text += chunk.text
        if chunk.stats is not None:
            if args.json:
                print(json.dumps({"token_ids": all_ids, "text": all_text, "stats": chunk.stats.to_dict()}))
            else:
                print(chunk.text, flush=True)
                print(json.dumps(chunk.stats.to_dict()), file=sys.stderr)
        elif args.json:
            print(json.dumps({"token_ids": chunk.token_ids, "text": chunk.text}), flush=True)
        else:
            print(chunk.text, end="", flush=True)
    return 0
