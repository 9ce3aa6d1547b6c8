"""One step's update: the loop over the subgroups (``loop``), what both sides share (``context``), the CPU's
side (``cpu_side``), the device's side with its streams and deferred work (``device_side``) and the device's
read-ahead buffers (``read_ahead``)."""
