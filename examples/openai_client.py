"""Talk to `kvasync serve` with the openai client (start the server first, see serving.md)."""

import os

from openai import OpenAI

# The openai client reads OPENAI_BASE_URL too; this is the server's default address.
client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"), api_key="unused"
)

completion = client.completions.create(model="kvasync-tiny", prompt="Hello", max_tokens=8)
print("completion:", repr(completion.choices[0].text), completion.usage)

chat = client.chat.completions.create(
    model="kvasync-tiny",
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    max_tokens=8,
)
print("chat:", repr(chat.choices[0].message.content), chat.choices[0].finish_reason)

stream = client.completions.create(model="kvasync-tiny", prompt="Once", max_tokens=8, stream=True)
print("stream:", [chunk.choices[0].text for chunk in stream if chunk.choices])
