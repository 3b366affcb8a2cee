"""What every layer uses. Imports nothing else of the project.

- hashing.py    counter hashes (SplitMix64) and named seeds: every random number is a function of integers
- batch.py      Rollout (the batch as tensors; select() trims padding; the sampled mask and what each episode did, for
                multi-turn episodes), left_pad, positions
- child.py      ChildProcess: a spawn-started process serving requests over a pipe, its address space limited, killed
                and replaced past a deadline (rewards, verifiers, environments run in one)
- schedule.py   LRSchedule: warm-up and constant / linear / cosine decay of every optimizer's learning rate
- settings.py   checks of numeric settings: each refusal names the setting's key, what it must be and what it got
- stop.py       a stop that a signal asked for, which the waits on a rollout engine heed
- waits.py      log lines around long waits: what is waited for, and how long it took
- resident.py   this process's resident memory (RSS), cheap enough to sample every few milliseconds
- http.py       request_within: an HTTP request bounded as a whole (a server trickling its answer cannot hold the caller
                past its deadline)
"""
