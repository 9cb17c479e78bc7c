"""hspmd.ir"""
