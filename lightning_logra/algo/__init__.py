"""The RL math on top of the sketches: losses, advantages, log-probs, the predicted KL, updates and step sizes. No
Lightning, nothing from the engines (imports base/ and sketch/).

- losses.py       the policy-gradient losses and their registry (`model.loss.type`: dapo, grpo, dr_grpo; gspo, cispo
                  with a clipped ratio to the sampler), and the sampler corrections (`model.rollouts.is_mode`)
- advantages.py   advantage estimators and their registry (`model.loss.scale_rewards`: group / batch / none, as TRL's)
- logprobs.py     completion log-probs (and entropy) a chunk of tokens at a time: no (m, C, V) logits
- kl.py           the predicted KL: q(D) of a whole Update, α = min(α_max, √(δ/q)), accumulated a chunk of tokens at
                  a time from hidden states; fp32 evaluation of low-precision models
- update.py       Update: one step's change (low-rank deltas + new dense values) as proposal, as applied, and as the
                  bytes a rollout engine receives; propose_dense / apply_dense_ (a dense step held back)
- step_size.py    StepSizeController: the contract the module asks for α between proposal and application, and the
                  StepContext it measures with
"""
