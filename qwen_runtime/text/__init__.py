"""Text in and out: the tokenizer (:mod:`.tokenizer`), the chat template's sandbox (:mod:`.sandbox`) and the chat
format a model brings (:mod:`.chat`)."""
