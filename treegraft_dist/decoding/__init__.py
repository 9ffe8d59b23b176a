"""Decoding, the serving-time runtime: the draft tree, the two drafters, the schedule policies (the learned
scheduler among them) and their signals, tree verification and sampling, the round loop for one request
and the batched target pass for many, and what each pass costs on this device. None of it imports Ray."""
