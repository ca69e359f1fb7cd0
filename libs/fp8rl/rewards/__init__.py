"""Reward models beside the rule graders: LLM-as-judge (GenRM) and sequence-classifier reward models on the embedded
engine (:mod:`.model`), the items they read and return (:mod:`.items`), and how their scores mix with the rule
grader's into a step's rewards (:mod:`.combine`).

Nothing is imported here: :mod:`.items` and :mod:`.combine` are light (the controller's side), :mod:`.model` loads
torch and the engines (the reward service's and the loop's side)."""
