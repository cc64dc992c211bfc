"""The sharded prefill's rings on real ranks: pass-KV (:mod:`.ring`) and pass-Q (:mod:`.passq`)."""
