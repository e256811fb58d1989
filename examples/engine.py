"""The reference serving engine in-process: a tiny byte-level model over a kvasync KV cache."""

import asyncio

from kvasync.serve import EngineConfig, open_engine


async def main() -> None:
    config = EngineConfig(preset="tiny", device="cpu", memory_limit=2 << 20)  # 2 MiB of KV
    async with open_engine(config) as engine:
        result = await engine.complete("Hello", max_tokens=16)
        print(repr(result.text), f"TTFT {result.record.ttft * 1000:.1f} ms")
        async for piece in engine.generate("Hello", max_tokens=16, timeout=5.0):
            print(piece, end="", flush=True)
        print()
        stats = engine.stats()
        print(f"{stats.finished} finished, {stats.preemptions} preemptions")


asyncio.run(main())
