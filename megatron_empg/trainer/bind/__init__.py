"""The bind step (``build.bind``): every setting of a run resolved and checked before anything
starts; where the work lands (``layout``), what only the machine can tell (``machine``), the
memory plan and its fixes (``memory_plan``, ``memory_terms``, ``memory_fixes``) and the launchers'
one check (``launch_check``). Imports only ``trainer.run`` of the trainer."""
