"""hspmd.runtime"""
