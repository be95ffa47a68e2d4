"""Talk to `orca serve`'s OpenAI-compatible HTTP API with the official `openai` client.

    orca serve &                                   # prints: orca-serve is up: HTTP http://127.0.0.1:8000, ...
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --prompt "def fibonacci(n):"

With `orca serve --api-key KEY` (or ORCA_API_KEY=KEY), pass --api-key KEY.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    completion = client.completions.create(model=model, prompt=args.prompt, max_tokens=args.max_tokens,
                                           temperature=0)
    print(f"completion ({completion.choices[0].finish_reason}, {completion.usage.completion_tokens} tokens):")
    print(args.prompt + completion.choices[0].text)

    print("chat, streamed:")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
        temperature=0.7, seed=1, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")


if __name__ == "__main__":
    main()
