"""One served engine for the whole package (compiling even the tiny model is the expensive part):
the shipped default model in fp32 with small limits, behind a plain server and one with an API key
and a 64 KiB body cap. ``ctx.ref`` holds greedy references from the same engine's offline
``generate``, run before it serves (the prefix tree is flushed in between, so the server starts cold)."""

from __future__ import annotations

import httpx
import openai
import pytest

from jaxserve.engine.flags import DEFAULT_MODEL_DIR
from jaxserve.engine.llm import EngineArgs, build_engine
from jaxserve.sampling_params import SamplingParams
from server.app import create_app
from server.async_engine import AsyncEngine
from tests.server.harness import CHAT, CONCURRENT, KEY, MODEL, N, Server


@pytest.fixture(scope="package")
def ctx():
    engine = build_engine(EngineArgs(model=str(DEFAULT_MODEL_DIR), dtype="float32", num_pages=256, num_slots=32,
                                     max_prefill_length=64, max_running_requests=8, progress=False))
    tok = engine.tokenizer
    chat_ids = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True))
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    prompts = {"hello": tok.encode("Hello there"), "ids": [5, 17, 42, 99, 300], "chat": chat_ids,
               **{f"c{i}": tok.encode(p) for i, p in enumerate(CONCURRENT)}}
    outs = engine.generate(list(prompts.values()), greedy)
    ref = dict(zip(prompts, outs))
    engine.scheduler.cache.flush()
    engine.check_invariants()
    aeng = AsyncEngine(engine).start()
    srv = Server(create_app(aeng, served_model_name=MODEL))
    keyed = Server(create_app(aeng, served_model_name=MODEL, api_key=KEY, max_body_bytes=1 << 16))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    http = httpx.Client(base_url=srv.url, timeout=120)
    yield type("Ctx", (), dict(engine=engine, aeng=aeng, url=srv.url, keyed_url=keyed.url, client=client,
                               http=http, ref=ref, prompts=prompts))
    http.close()
    srv.close()
    keyed.close()
    aeng.stop()
