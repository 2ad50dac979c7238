"""Turning logits into text: sampling (:mod:`.sampling`), one row's step (:mod:`.stepper`), structured output
(:mod:`.structured`), the generation loop (:mod:`.generate`) and evaluation (:mod:`.evaluate`)."""
