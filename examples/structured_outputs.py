"""Structured outputs and tool calling through `orca serve`'s OpenAI-compatible API, with the `openai` client.

    orca serve &
    python examples/structured_outputs.py --base-url http://127.0.0.1:8000/v1

Even the random-weight demo model answers in the shape asked: the engine masks every token that
would break it. Each result is checked here (the JSON parses, the regex matches).
"""

from __future__ import annotations

import argparse
import json
import re

from openai import OpenAI

PAINT = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "shade": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["color", "shade"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Pick a colour"}]

    reply = client.chat.completions.create(model=model, messages=ask, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "paint", "schema": PAINT}})
    paint = json.loads(reply.choices[0].message.content)
    print("json_schema:", paint)

    text = client.completions.create(model=model, prompt="Phone: ", max_tokens=16,
                                     extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}).choices[0].text
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
    print("regex:", text)

    choice = client.chat.completions.create(model=model, messages=ask, max_tokens=8,
                                            extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    print("choice:", choice.choices[0].message.content)

    call = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                          tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                          max_tokens=128)
    tool_call = call.choices[0].message.tool_calls[0]
    print("tool call:", tool_call.function.name, json.loads(tool_call.function.arguments),
          call.choices[0].finish_reason)

    print("tool call, streamed: ", end="")
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=128, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            print(delta.function.arguments or "", end="", flush=True)
    print()


if __name__ == "__main__":
    main()
