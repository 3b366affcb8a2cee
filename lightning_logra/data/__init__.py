"""Prompt sets and the embedded tasks.

- prompts.py         prompt datasets through datasets.load_dataset (hub subsets, revisions, local files; conversations;
                     DAPO-Math, MATH-500 presets; deduplication)
- module.py          the data modules: the prompts of step s are a pure function of (seed, s); max_prompt_length
- arith.py           the embedded arithmetic task (2-digit addition, the answer reversed)
- add3.py            the harder one: 3-digit addition, least significant digit first
- tool_task.py       the embedded multi-turn task (3-digit products, a `multiply` tool) and its tokenizer, whose chat
                     template renders tool calls
- reasoning_gym.py   a weighted mix of reasoning-gym tasks, held-out sets, rows that name their task
- tiny_arith/, add3/, tools/   the embedded tasks' shipped models (each folder's README.md says how it was made)
"""
