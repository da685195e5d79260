"""Quality checks that need no task data: output fidelity against the full cache (:mod:`.fidelity`,
:mod:`.output_fidelity`, :mod:`.continuations`) and the calibration of method hyperparameters (:mod:`.calibrate`;
``docs/results-fidelity.md``, ``docs/profiles.md``)."""
