"""Tasks: one module each, holding a task's prompts, its rewards and what it needs of ``data``.

A task module defines ``TASK = task.Task(name, rewards, source, build_source)``; ``registry``
lists the modules (``TASKS``) and derives from them the reward names of ``data.reward``
(``REWARDS``) and the prompt builders of ``data.source`` (``PROMPT_SOURCES``). ``arithmetic``: the
CPU demo's synthetic problems; ``math``: math datasets, checked by math-verify (in the worker
processes of ``math_verifier``); ``search_qa``: Search-R1's question answering. Tasks build on
the generic pieces of ``rollout`` (``rollout.data``'s datasets, ``rollout.rewards``' contract),
which never import a task.
"""
