"""Request management: io structs and ipc, the request front shared by the Engine and the
TokenizerManager, the Scheduler (admission, batching, grammar, finish), its policy, stop
conditions, output gathering, the detokenizer and their process entries. May import every
runtime room but entrypoints."""
