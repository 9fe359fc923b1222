"""A program in SGLang's frontend language, run by test_sglang_clients.py against a real srt
server: `python sglang_frontend_program.py URL PREFIX` with the stock `sglang` package on
PYTHONPATH. Prints one JSON object of what each part gave; the test checks it against srt's own
answers. Nothing here imports srt.
"""

from __future__ import annotations

import json
import sys

import sglang as sgl

url, prefix = sys.argv[1], sys.argv[2]
sgl.set_default_backend(sgl.RuntimeEndpoint(url, chat_template_name="chatml"))
out: dict = {}

GEN_PROMPT = "The capital of France is"


@sgl.function
def plain(s, prompt):
    s += prompt + sgl.gen("answer", max_tokens=16, temperature=0, stop=".")


state = plain.run(prompt=GEN_PROMPT)
out["gen"] = {"text": state["answer"], "meta": state.get_meta_info("answer")}


@sgl.function
def choose(s):
    s += "Q: What is the capital of France?\nA: The capital of France is "
    s += sgl.select("city", choices=["Paris", "London", "Berlin"])


out["select"] = choose.run()["city"]


@sgl.function
def forks(s, prefix):
    s += prefix
    branches = s.fork(2)
    for i, b in enumerate(branches):
        b += f"Question {i}: what is this text about? Answer:"
        b += sgl.gen("answer", max_tokens=6, temperature=0)
    branches.join()
    s["metas"] = [b.get_meta_info("answer") for b in branches]
    s["texts"] = [b.text() for b in branches]


state = forks.run(prefix=prefix)
out["fork"] = {"cached_tokens": [m["cached_tokens"] for m in state["metas"]],
               "prompt_tokens": [m["prompt_tokens"] for m in state["metas"]]}

PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@sgl.function
def phone(s):
    s += "Write a phone number: " + sgl.gen("number", max_tokens=20, temperature=0, regex=PHONE)


out["regex"] = {"pattern": PHONE, "text": phone.run()["number"]}

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 12}},
          "required": ["name", "age", "city"]}


@sgl.function
def person(s):
    s += "A person as JSON: " + sgl.gen("json", max_tokens=64, temperature=0,
                                       json_schema=json.dumps(SCHEMA))


out["json"] = {"schema": SCHEMA, "text": person.run()["json"]}


@sgl.function
def chat(s):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("first", max_tokens=12, temperature=0))
    s += sgl.user("And of Italy?")
    s += sgl.assistant(sgl.gen("second", max_tokens=12, temperature=0))


state = chat.run()
out["chat"] = {"first": state["first"], "second": state["second"],
               "roles": [m["role"] for m in state.messages()], "text": state.text()}

state = plain.run(prompt=GEN_PROMPT, stream=True)
out["stream"] = {"chunks": list(state.text_iter("answer"))}

batch = plain.run_batch([{"prompt": p} for p in ("The capital of Italy is",
                                                 "The capital of Spain is", GEN_PROMPT)])
out["run_batch"] = [s["answer"] for s in batch]

sgl.flush_cache()
out["flush_cache"] = True
info = sgl.get_server_info()
out["server_info"] = {"keys": sorted(info)}
print(json.dumps(out))
