"""What cb_sync changes on a model for the length of a call, and puts back: swapped forwards and attributes, the
generation mode (attention implementation, eval mode), and rotary tables computed once per compiled step."""
