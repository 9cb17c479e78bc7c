"""Cluster-file text shared by tests: the H800 / H20 device types and links of Hetu v2's Table 3
(float32 peaks included, for the CPU runs that emulate them)."""

H800_H20_TYPES_AND_LINKS = """
device_types:
  H800: {flops: {bfloat16: 9.9e14, float32: 6.7e13}, hbm_bandwidth: 3.35e12, hbm_capacity: 8.0e10}
  H20: {flops: {bfloat16: 1.48e14, float32: 4.4e13}, hbm_bandwidth: 4.0e12, hbm_capacity: 9.6e10}
links:
  nvlink: {bandwidth: 2.0e11, latency: 1.0e-6}
  ib: {bandwidth: 2.5e10, latency: 5.0e-6}
"""

# one node of two H800s and one of two H20s (Hetu v2's two types)
H800_H20_TWO_NODES = "name: h800-h20" + H800_H20_TYPES_AND_LINKS + """nodes:
  - {type: H800, devices: 2}
  - {type: H20, devices: 2}
intra: {H800: nvlink, H20: nvlink}
inter: ib
"""
