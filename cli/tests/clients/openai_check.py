"""Drives a LeanStream server with the official `openai` package: models,
chat and completions, each streamed and not, usage, and an error the client
must see as BadRequestError. Prints one JSON object for the Rust test."""
import json
import sys

import openai
from openai import OpenAI

url, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = OpenAI(base_url=url + "/v1", api_key=sys.argv[4] if len(sys.argv) > 4 else "unused", max_retries=0)
model = client.models.list().data[0].id
messages = [{"role": "user", "content": prompt}]

chat = client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0)
out = {
    "model": model,
    "chat": chat.choices[0].message.content,
    "chat_finish": chat.choices[0].finish_reason,
    "chat_usage": [chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens],
}

parts, finish, usage = [], None, None
for chunk in client.chat.completions.create(
    model=model, messages=messages, max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True}
):
    if chunk.usage:
        usage = [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
out.update(chat_stream="".join(parts), chat_stream_chunks=len(parts), chat_stream_finish=finish, chat_stream_usage=usage)

comp = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
out["completion"] = comp.choices[0].text
parts = []
for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True):
    parts.extend(c.text for c in chunk.choices if c.text)
out["completion_stream"] = "".join(parts)

try:
    client.chat.completions.create(model=model, messages=messages, n=2)
    out["n2_error"] = None
except openai.BadRequestError as e:
    out["n2_error"] = [e.status_code, e.body.get("param") if isinstance(e.body, dict) else None]

print(json.dumps(out))
