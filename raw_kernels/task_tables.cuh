// Row widths of the transfer task tables, shared by the schedule compiler (schedule.cu)
// and the transfer kernels (transfer.cu). ultraep/transfer/schedule.py defines every
// field, reads these widths and names the weight-task columns (WEIGHT_TASK_COLUMNS, in
// the order of WeightTaskField; a CPU test compares them).
#pragma once

#define WEIGHT_TASK_FIELDS 8  // its columns:
enum WeightTaskField { SRC_REF, CHUNK, TILE_BEGIN, TILE_END, DEST_BEGIN, DEST_END, WAIT_SLOT, PUBLISH };
#define DEST_FIELDS 3         // rank, slot_heap_offset, flag_slot
#define GRAD_TASK_FIELDS 5    // dst_ref, byte_offset, nbytes, src_begin, src_end
#define GRAD_SRC_FIELDS 2     // rank, heap_offset
